"""Handwritten digits without a download: scikit-learn's bundled 8x8 digits, upsampled to
28x28 like MNIST, or real MNIST IDX files when ``data.path`` points at them."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def load_digits_28(validation_fraction: float = 0.2, seed: int = 0):
    """(train_x, train_y, val_x, val_y) as float tensors (N, 1, 28, 28) and int64 labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
    x = (x - 0.1307) / 0.3081
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(x) * validation_fraction)
    val, train = order[:n_val], order[n_val:]
    return x[train], y[train], x[val], y[val]


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
