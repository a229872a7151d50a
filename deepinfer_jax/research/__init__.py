"""Research tools over the model's pure functions: training the shipped small model (``train``), its
corpus (``corpus``), weight quantization-aware training (``qat``) and the evaluation behind the model card
(``evaluate``). Device code may be imported here; ``optax`` is an optional extra (``pip install .[train]``)
needed by ``train`` only.
"""
