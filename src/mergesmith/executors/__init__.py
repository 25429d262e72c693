"""Executors other than the local thread pool (`mergesmith.executor.LocalExecutor`).

Each takes the same arguments as `LocalExecutor` and runs the unfinished shards of a plan into the
output directory, recording finished shards in the journal, so `api.execute_plan` can use any of
them and resume works the same whichever ran before. Optional backends import their dependency only
in their own module, which `api` imports only when asked for that executor.
"""
