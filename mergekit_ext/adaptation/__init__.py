"""SyMerge, test-time adaptation: the method's declaration and everything that runs it.

Importing this package registers the method (:mod:`~mergekit_ext.adaptation.symerge`).

- :mod:`~mergekit_ext.adaptation.symerge`: the method's ``MethodInfo`` and registration
- :mod:`~mergekit_ext.adaptation.parameters`: its parameters, declared once
- :mod:`~mergekit_ext.adaptation.run`: inputs, memory check, models, adaptation, saving
- :mod:`~mergekit_ext.adaptation.structure`: body / head / task-layer roles of each parameter
- :mod:`~mergekit_ext.adaptation.problem`: θ_0 + Σ λ Δ as a differentiable function, task layers
- :mod:`~mergekit_ext.adaptation.losses`: the self-labelling losses (pure tensor functions)
- :mod:`~mergekit_ext.adaptation.trainer`: data, teacher cache, the Adam loop, evaluation
- :mod:`~mergekit_ext.adaptation.memory`: the memory estimate from checkpoint headers
- :mod:`~mergekit_ext.adaptation.export`: the merged body, task checkpoints and PEFT adapters
"""

from mergekit_ext.adaptation import symerge as symerge  # noqa: F401  (registers SyMerge)
