"""jaxlm's kernels behind one registry (registry.py): models ask `Kernels` for an op, `resolve` picks the
implementation per platform, dtype and mesh."""

from jaxlm.kernels.registry import (AUTO, EXECUTION, IMPLEMENTATIONS, Implementation, Kernels,  # noqa: F401
                                    resolve, runnable_on, validate_kernels)
