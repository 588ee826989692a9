"""mergekit-ext's merge methods. Importing a module registers its method (one line each).

SyMerge, which runs its own adaptation loop over whole models, is declared and registered in
:mod:`mergekit_ext.adaptation` (one layer up, beside the executor).
"""

from mergekit_ext.methods import ace as ace  # noqa: F401
from mergekit_ext.methods import block_distillation as block_distillation  # noqa: F401
from mergekit_ext.methods import chain_of_merges as chain_of_merges  # noqa: F401
from mergekit_ext.methods import qp_projection as qp_projection  # noqa: F401
from mergekit_ext.methods import regmean as regmean  # noqa: F401
from mergekit_ext.methods import wudi as wudi  # noqa: F401
from mergekit_ext.methods.parameters import MethodParameters, ParameterDoc
from mergekit_ext.methods.registry import (
    MethodInfo,
    all_method_names,
    describe_method,
    ext_method_info,
    ext_methods,
    register_method,
)

__all__ = [
    "MethodInfo",
    "MethodParameters",
    "ParameterDoc",
    "all_method_names",
    "describe_method",
    "ext_method_info",
    "ext_methods",
    "register_method",
]
