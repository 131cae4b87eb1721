"""relserve's micro-benchmarks, one module each, run as ``python -m relserve.loadtest.bench.<name>``; the load-test
product (:mod:`relserve.loadtest`) never imports this package. Every benchmark takes its common arguments, timing,
side-by-side ratios and JSON output from :mod:`.harness`; what each measures and the figures recorded so far are in
docs/performance.md.

Offline, in one process: ``encoder`` (ours vs transformers), ``unpadded``, ``relpos``, ``onnx_encoder``, ``onnx_ops``,
``onnx_translation``, ``decode_step``, ``train_autocast``, ``instances``. Against ``relserve serve``: ``serving``,
``translation``, ``isolation``, ``hostile``, ``http_flood``, ``grpc_flood``, ``shape_soak``. ``cpu`` runs the CPU paths of several of them in one run. ``randmodel``
(random checkpoints) and ``gil`` (py-spy GIL sampling) are their helpers.
"""
