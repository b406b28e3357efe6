"""What a step raises back to the flow must cross Dask's process boundary whole.

Dask pickles a step's exception to send it to the client; one that does not pickle (boto3's
errors hold the open file they were uploading: ``cannot pickle '_io.BufferedReader'``)
reached the flow as a bare string, its type and meaning lost. So an exception that does not
survive a pickle round trip is replaced, at the boundary, by a plain RuntimeError with its
type and message.
"""

from __future__ import annotations

import pickle

__all__ = ["crossing_error"]


def crossing_error(err: BaseException) -> BaseException:
    """``err`` itself if it pickles and unpickles, else a RuntimeError carrying its text."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
    return err
