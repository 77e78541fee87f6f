"""opfuse's HTTP API server: routes, database, blob store, auth and the job queue.

Never imports torch or triton; of opfuse it uses only `opfuse.frontend` (onnx) for upload checks.
"""
