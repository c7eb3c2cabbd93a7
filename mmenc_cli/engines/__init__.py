"""Engines that run an output's tasks for the user: `mmenc ray` on a Ray cluster.

An engine only chooses task indexes, starts tasks and retries the lost ones; the exactly-once
promise lives in the output (exclusive create, leases, resume). `job.py` is the engine-free part (a
job's spec, its tasks' outcomes, one result and one exit code); `ray_tasks.py` runs in Ray's
workers, `ray_driver.py` in the `mmenc ray` process. Slurm arrays and Kubernetes Indexed Jobs need
no module here: `mmenc encode` reads their task variables (`cli/encode.task_from_env`).
"""
