"""One module per kernel family, each validate -> plan -> launch: :mod:`~cukv.ops.decode`,
:mod:`~cukv.ops.prefill`, :mod:`~cukv.ops.append`, :mod:`~cukv.ops.merge`, :mod:`~cukv.ops.dequant`, :mod:`~cukv.ops.mla_decode`.
The public names are re-exported by :mod:`cukv` (``cukv.decode`` and ``cukv.prefill`` are the functions)."""
