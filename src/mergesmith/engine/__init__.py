"""The engine: a merge as a Plan (data), the planner for merge configs, and the executors that run any plan.

`plan` is the Plan; `planning/` builds one from a merge config; `execution/` runs it (local threads in parts:
admission, compute, writing; or Ray), writing through `io`; `run` is the output-directory protocol (plan,
execute, finish, resume) every command shares. Features add recipe ops and vocabulary steps through
`extensions` (registered at start-up by the root package); the engine imports no feature.
"""
