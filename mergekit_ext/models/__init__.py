"""Everything that reads a model: folders and Hub ids, configs and classes, checkpoints, LoRA.

- :mod:`~mergekit_ext.models.model_paths`: a model reference → local folder(s), downloads;
- :mod:`~mergekit_ext.models.model_files`: the files of one folder, checked before any read;
- :mod:`~mergekit_ext.models.model_class`: the transformers class of a config and what its
  ``save_pretrained`` writes;
- :mod:`~mergekit_ext.models.checkpoint`: reading tensors under their checkpoint names;
- :mod:`~mergekit_ext.models.lora`: PEFT adapters folded into their base;
- :mod:`~mergekit_ext.models.families`: where a network's blocks and linear layers are;
- :mod:`~mergekit_ext.models.mergekit_definitions`: architecture definitions mergekit uses
  inside our runs only (``our_architectures``);
- :mod:`~mergekit_ext.models.tokenization`: the output's tokenizer and chat template;
- :mod:`~mergekit_ext.models.completeness`: the written checkpoint is complete and in layout.

Layer 1 of docs/architecture.md: these modules import only the lowest layer (errors, ...).
"""
