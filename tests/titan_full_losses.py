"""``torchtitan_ext.train`` that also prints each step's loss and gradient norm at full
precision (``float.hex``), for tests comparing runs exactly: torchtitan logs the loss
with 5 decimals. Run as ``torchrun ... -m tests.titan_full_losses``."""

import os
import sys

import torchtitan_ext.register  # noqa: F401  (registers RRFP and hooks the Trainer)
from torchtitan.components import metrics
from torchtitan.train import main, Trainer

FULL_LOSS = "rrfp-test step {step} loss {loss} grad_norm {grad_norm}"

_log = metrics.MetricsProcessor.log


def _log_in_full(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
    if float(global_avg_loss) >= 0:  # pipeline ranks without the last stage log -1
        line = FULL_LOSS.format(step=step, loss=float(global_avg_loss).hex(),
                                grad_norm=float(grad_norm).hex())
        # One write of a short line: atomic on a pipe, so lines of ranks printing at once
        # (tensor-parallel peers) do not interleave.
        os.write(sys.stdout.fileno(), f"\n{line}\n".encode())
    return _log(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)


metrics.MetricsProcessor.log = _log_in_full

if __name__ == "__main__":
    main(Trainer)
