"""The engine: a merge as a Plan (data), the planner for merge configs, and the executors that run any plan.

Local threads (`executor`) or Ray (`ray_executor`), fed by `input_feed`, writing through `io`; `run` is the
output-directory protocol (plan, execute, finish, resume) every command shares.
"""
