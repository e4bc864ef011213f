"""jaxlm's kernels behind one registry (registry.py): models ask `Kernels` for an op, `resolve` picks the
implementation per platform, dtype and mesh."""

from jaxlm.kernels.registry import (AUTO, IMPLEMENTATIONS, Implementation, Kernels, resolve,  # noqa: F401
                                    runnable_on)
