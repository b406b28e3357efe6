"""Batches: the ``DataLoader`` and its resumable shuffle, an epoch's length, training units
(``Batch``, ``Epoch``), and feeding the device."""

__all__: list[str] = []
