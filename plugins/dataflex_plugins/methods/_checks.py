"""Small shared guards for the built-in methods: finiteness of the row scores an actuator reads.

The pipeline already rejects non-finite scores before an actuator runs; these guards make the
components safe to call directly too (tests, other hosts), and name the component and field.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dataflex_bus.batch import Batch
from dataflex_bus.errors import BatchFieldError


def check_row_values(component: str, field: str, values: Tensor, batch: Batch) -> None:
    """Raise if a per-row ``[B]`` tensor holds NaN/inf on a real row (one cheap pass over ``B``)."""
    if values.dim() != 1 or values.shape[0] != len(batch):
        raise BatchFieldError(component, field,
                              f"expected one value per row, shape ({len(batch)},), got {tuple(values.shape)}")
    bad = batch.nonfinite_rows(values)
    if bad is not None:
        rows = torch.nonzero(bad).flatten()[:5].tolist()
        raise BatchFieldError(component, field, f"non-finite values (NaN/inf) on rows {rows}")


def check_token_shape(component: str, field: str, values: Tensor, batch: Batch) -> None:
    """Raise unless ``values`` is ``[B, T]`` like the batch's response mask."""
    width = batch.width_of("response_mask")  # the token mask's width, without making the mask
    shape = (len(batch), width) if width is not None else tuple(batch.token_mask.shape)
    if tuple(values.shape) != shape:
        raise BatchFieldError(component, field, f"expected per-token values of shape {shape}, "
                              f"got {tuple(values.shape)}")
