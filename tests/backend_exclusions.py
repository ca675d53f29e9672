"""ONNX backend node tests that gradgen's executor cannot pass, with the reason for each."""

EXCLUDED: dict[str, str] = {}
