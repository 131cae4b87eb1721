"""The model repository: directories of models (each a checkpoint, or numbered version sub-directories) scanned by
:mod:`.layout` (no torch), and the :class:`.manager.RepositoryManager` that loads, swaps and unloads their
versions in the server's registry (control modes none / poll / explicit, as Triton's). docs/operations.md
("Model repository") describes the layout and the guarantees.
"""
