"""The opfuse worker: claims jobs over HTTP and runs the compile pipeline in a killable child process.

`workers.worker` is the long-running process; `workers.pipeline` is the child that runs one job.
"""
