"""CompileMask: attention masks written once in a small region language, compiled
analytically into the exact visible key intervals of every query row and a tile
descriptor, for PyTorch users.

>>> import compilemask
>>> plan = compilemask.builtin("causal").plan(1000)
>>> plan.visible_pairs
500500
>>> plan.intervals(4)
[(0, 5)]

Compiling and planning need nothing but this package. The functions that produce or take
torch tensors (:func:`attention`, :func:`paged_attention`, :func:`permute`, :func:`unpermute`,
:meth:`Plan.to_block_mask`, :meth:`Plan.to_tensors`, :meth:`Step.to_tensors`)
import torch when first called and raise :class:`ImportError` naming what is missing
when it is not installed. See ``docs/python.md`` and ``docs/language.md``.
"""

from . import _native
from ._native import DENSE_LIMIT, Diagnostic, MaskSyntaxError, PlanError
from ._program import (CompileMaskWarning, MaskImage, Parameter, Plan, PlanTensors, Program,
                       ScoreTensors, builtin, builtins, compile)
from ._serve import Step, StepTensors, paged_attention
from ._torch import attention, permute, unpermute

__version__: str = _native.__version__

__all__ = [
    "CompileMaskWarning",
    "DENSE_LIMIT",
    "Diagnostic",
    "MaskImage",
    "MaskSyntaxError",
    "Parameter",
    "Plan",
    "PlanError",
    "PlanTensors",
    "Program",
    "ScoreTensors",
    "Step",
    "StepTensors",
    "__version__",
    "attention",
    "builtin",
    "builtins",
    "compile",
    "paged_attention",
    "permute",
    "unpermute",
]
