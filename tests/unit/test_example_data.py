"""The MNIST example's digits: read from scikit-learn's bundled file without importing
scikit-learn (its import took 0.8 s of every worker's first step), with exactly the values
``sklearn.datasets.load_digits`` gives."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mnist"


def _example_data():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("mnist_example_data", EXAMPLE / "data.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bundled_digits_equal_scikit_learns_loader() -> None:
    from sklearn.datasets import load_digits

    images, targets = _example_data()._bundled_digits()
    digits = load_digits()
    assert images.shape == (1797, 8, 8)
    assert np.array_equal(images, digits.images)
    assert np.array_equal(targets, digits.target)
    assert images.dtype == digits.images.dtype and targets.dtype == digits.target.dtype


def test_loading_the_digits_does_not_import_scikit_learn() -> None:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import data; "
        "x, y, vx, vy = data.load_digits_28(); "
        "print(tuple(x.shape), tuple(vx.shape), 'sklearn' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(EXAMPLE)], check=True, capture_output=True, text=True
    ).stdout.split("\n")[0]
    # 1797 digits, 20% held out (seeded order); scikit-learn never imported.
    assert out == "(1438, 1, 28, 28) (359, 1, 28, 28) False"
