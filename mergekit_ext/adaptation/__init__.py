"""Test-time adaptation machinery for SyMerge (:mod:`mergekit_ext.methods.symerge`).

- :mod:`~mergekit_ext.adaptation.structure`: body / head / task-layer roles of each parameter
- :mod:`~mergekit_ext.adaptation.problem`: θ_0 + Σ λ Δ as a differentiable function, task layers
- :mod:`~mergekit_ext.adaptation.losses`: the self-labelling losses (pure tensor functions)
- :mod:`~mergekit_ext.adaptation.trainer`: data, teacher cache, the Adam loop, evaluation
- :mod:`~mergekit_ext.adaptation.memory`: the memory estimate from checkpoint headers
- :mod:`~mergekit_ext.adaptation.export`: the merged body, task checkpoints and PEFT adapters
"""
