"""Applications of qformats and scalify, runnable from the repository root (``python -m examples.train``).

Not installed with the library: they may use what the library's users install beside it (optax,
scikit-learn, matplotlib), never what the library keeps private.
"""
