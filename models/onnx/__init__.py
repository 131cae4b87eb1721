"""relserve.models.onnx: ONNX export of both model families and running the graphs on ONNX Runtime."""
