"""The opfuse worker: claims jobs over HTTP and runs the compile pipeline in a killable child process.

`workers.worker` is the long-running process (the claim loop, heartbeats, results) and
`workers.config` its configuration and command line; `workers.job_dirs` keeps each job's private
directory; `workers.child` starts and watches the child, and `workers.pipeline` is the child that
runs one job.
"""
