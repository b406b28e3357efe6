"""Handwritten digits without a download: scikit-learn's bundled 8x8 digits, upsampled to
28x28 like MNIST, or real MNIST IDX files when ``data.path`` points at them."""

from __future__ import annotations

import gzip
import importlib.util
import struct
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def load_digits_28(validation_fraction: float = 0.2, seed: int = 0):
    """(train_x, train_y, val_x, val_y) as float tensors (N, 1, 28, 28) and int64 labels."""
    images, targets = _bundled_digits()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
    x = (x - 0.1307) / 0.3081
    y = torch.tensor(targets, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(x) * validation_fraction)
    val, train = order[:n_val], order[n_val:]
    return x[train], y[train], x[val], y[val]


def _bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits as (images (1797, 8, 8), labels), the values its
    ``load_digits`` returns. Read from its data file: importing ``sklearn.datasets`` took
    0.8 s of every worker's first step (it imports SciPy)."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    folders = spec.submodule_search_locations if spec else None
    for folder in folders or []:
        csv = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if csv.exists():
            with gzip.open(csv, "rt") as f:
                table = np.loadtxt(f, delimiter=",")
            if table.ndim == 2 and table.shape[1] == 65:  # 64 pixels, then the label
                return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)
    from sklearn.datasets import load_digits  # another layout: its own loader

    digits = load_digits()
    return digits.images, digits.target


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        _, _dtype, ndim = struct.unpack(">HBB", f.read(4))
        shape = struct.unpack(">" + "I" * ndim, f.read(4 * ndim))
        return np.frombuffer(f.read(), dtype=np.uint8).reshape(shape)


def load_mnist_idx(directory: str):
    """MNIST from the four IDX files (optionally .gz) in ``directory``."""
    root = Path(directory)

    def find(stem: str) -> Path:
        for name in (stem, stem + ".gz"):
            if (root / name).exists():
                return root / name
        raise FileNotFoundError(f"data.path {directory!r} has no {stem}[.gz]")

    def images(stem: str) -> torch.Tensor:
        x = torch.tensor(_read_idx(find(stem)), dtype=torch.float32).unsqueeze(1) / 255.0
        return (x - 0.1307) / 0.3081

    def labels(stem: str) -> torch.Tensor:
        return torch.tensor(_read_idx(find(stem)), dtype=torch.long)

    return (
        images("train-images-idx3-ubyte"),
        labels("train-labels-idx1-ubyte"),
        images("t10k-images-idx3-ubyte"),
        labels("t10k-labels-idx1-ubyte"),
    )
