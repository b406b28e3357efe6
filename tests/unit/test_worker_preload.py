"""What the warm workers' forkserver imports before it forks them, and the S3 client an
experiment's end builds only when it needs one (issue 24: a fresh worker's first step spent
3.7 s importing torch._dynamo, the MLflow store and the re-run main module)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from cluster import warm_forkserver
from registry.servers import s3

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("spec_name", "named"),
    [
        ("flows.experiment", "flows.experiment"),  # python -m flows.experiment
        ("prefect.engine", "prefect.engine"),  # a deployment's flow run
        ("pytest.__main__", None),  # a package's __main__: children do not re-run it
        (None, None),  # a script run by path: the "__main__" preload covers it
    ],
)
def test_the_main_module_children_would_re_run_is_named_to_the_forkserver(
    monkeypatch: pytest.MonkeyPatch, spec_name: str | None, named: str | None
) -> None:
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name=spec_name) if spec_name else None  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setenv(warm_forkserver.MAIN_MODULE_ENV, "stale")
    context = types.SimpleNamespace(set_forkserver_preload=lambda names: None)
    warm_forkserver.configure(context)
    assert warm_forkserver.main_module_by_name() == named
    assert os.environ.get(warm_forkserver.MAIN_MODULE_ENV) == named


def test_the_forkserver_marks_its_main_first_and_freezes_last() -> None:
    order = warm_forkserver.preload_modules()
    assert order[:2] == ["__main__", "cluster.forkserver_main"]  # before anything forks
    assert order[-1] == "cluster.forkserver_heap"  # last: it freezes everything imported before
    assert "flows.experiment" not in order and "prefect" not in order


def test_a_forked_child_does_not_run_the_main_module_again(tmp_path: Path) -> None:
    """``python -m counted_main``, whose body imports a module that counts its imports (as
    flows.experiment imports Prefect): a child forked from a forkserver that imported
    cluster.forkserver_main imports it neither as ``__mp_main__`` nor otherwise."""
    runs = tmp_path / "runs"
    (tmp_path / "heavy.py").write_text(f"open({str(runs)!r}, 'a').write('imported\\n')\n")
    (tmp_path / "probe.py").write_text(
        "import sys\ndef child(queue):\n    queue.put('heavy' in sys.modules)\n"
    )
    (tmp_path / "counted_main.py").write_text(
        "import multiprocessing\n"
        "import heavy\n"
        "if __name__ == '__main__':\n"
        "    import probe\n"
        "    from cluster import warm_forkserver\n"
        "    context = multiprocessing.get_context('forkserver')\n"
        "    warm_forkserver.configure(context)\n"
        "    context.set_forkserver_preload(['cluster.forkserver_main'])  # the rest is slow\n"
        "    queue = context.Queue()\n"
        "    process = context.Process(target=probe.child, args=(queue,))\n"
        "    process.start()\n"
        "    print(queue.get(timeout=60))\n"
        "    process.join()\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    done = subprocess.run(
        [sys.executable, "-m", "counted_main"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert runs.read_text() == "imported\n"  # by the parent only
    assert done.stdout.strip() == "False"


def _imported_after(uri: str) -> dict[str, bool]:
    code = (
        "import json, sys; from registry.runs.tracking import import_tracking_store; "
        f"import_tracking_store({uri!r}); "
        "print(json.dumps({m: m in sys.modules for m in "
        "('mlflow.store.tracking.sqlalchemy_store', 'sqlalchemy')}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return dict(json.loads(done.stdout))


def test_a_database_uri_has_its_store_module_imported_without_opening_it(tmp_path: Path) -> None:
    database = tmp_path / "mlflow.db"
    imported = _imported_after(f"sqlite:///{database}")
    assert imported == {"mlflow.store.tracking.sqlalchemy_store": True, "sqlalchemy": True}
    assert not database.exists()  # imported, not opened: no connection crosses a fork


def test_a_server_uri_imports_no_database_store() -> None:
    imported = _imported_after("http://127.0.0.1:5000")
    assert imported["mlflow.store.tracking.sqlalchemy_store"] is False


def test_the_lazy_s3_client_is_built_at_its_first_use_and_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[str | None] = []

    def fake_client(endpoint_url: str | None = None) -> types.SimpleNamespace:
        built.append(endpoint_url)
        return types.SimpleNamespace(list_objects_v2=lambda **kw: {"asked": kw})

    monkeypatch.setattr(s3, "client", fake_client)
    lazy = s3.LazyClient("http://127.0.0.1:8333")
    assert built == []  # an experiment with only local checkpoints never builds one
    assert lazy.list_objects_v2(Bucket="b") == {"asked": {"Bucket": "b"}}
    assert lazy.list_objects_v2(Bucket="c") == {"asked": {"Bucket": "c"}}
    assert built == ["http://127.0.0.1:8333"]
