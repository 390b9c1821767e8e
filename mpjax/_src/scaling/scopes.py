"""The name scopes of `loss_scaled`'s own ops, which `mpjax.report` groups under one row.

Everything `loss_scaled`'s update and `scale_loss` add to a step (the unscale, the finite
check, the skip branches, the master weights, the loss-scale update) runs under
`LOSS_SCALING_SCOPE`; the wrapped optimizer's own update under `INNER_SCOPE` inside it.
"""

from __future__ import annotations

__all__ = ["INNER_SCOPE", "LOSS_SCALING_SCOPE"]

LOSS_SCALING_SCOPE = "mpjax_loss_scaling"
INNER_SCOPE = "mpjax_inner_optimizer"
