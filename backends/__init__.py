"""epcc code-generation backends (cuda, supa, rdma, cpu).

Each backend lowers the scheduled `epcc` IR to sources and a launch plan inside a bundle that
the runtime loads without MLIR.  Backends arrive with their issues; the shared pieces of the
runtime they target live in runtime/native/ (bounded waits on flags).
"""
