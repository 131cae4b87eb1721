"""The wire surfaces, one module each; a frontend decodes its wire format into a task request, calls the task
core (:mod:`relserve.service.tasks`), and encodes the result or the domain error. No frontend imports another.

Frontends: ``grpc_v1`` (the relserve.v1.Inference servicer), ``kserve_v2_grpc`` (KServe v2 /
``inference.GRPCInferenceService``), ``http_v2`` (KServe v2 REST), ``http_v1`` (relserve /v1 JSON).
Shared by them: ``grpc_transport`` (the gRPC error/trailer table, the metrics wrapper, tolerant decoding,
stream writes), ``http_transport`` (the aiohttp listener the HTTP surfaces register their routes on: TLS,
tokens, body limit and decoding, deadline header, the HTTP error table, drain and metrics accounting,
/metrics), ``messages`` (protobuf messages: undecodable requests, the reply size limit), ``v1_codec``
(relserve.v1 messages <-> tasks, for gRPC and its JSON mapping), ``oip_codec`` (Open Inference Protocol
tensors <-> tasks, for both KServe v2 transports), ``json_codec`` (KServe v2 REST JSON <-> OIP tensors).
"""
