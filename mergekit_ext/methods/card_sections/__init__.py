"""Each method's model-card section: a summary of its diagnostics and its plots.

The method registers them through ``MethodInfo.report`` (:class:`~mergekit_ext.methods.registry.MethodReport`);
the card loops over the registered methods and never dispatches on a method's name.
"""
