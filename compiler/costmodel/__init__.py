"""The cost model's terms, shared by the passes that size work for them and by the simulator.

* uniform.py: what uniform top-k routing makes of a token: the probability that it hits a set of
  experts, its expected expert rows on a rank it hits and the ranks it hits;
* rates.py: the per-SM rates of the topology's `sm` line as the kinds of work use them (copy,
  reduce, add), the GPU proxy path's stage and apply rates and the credit window of an RDMA
  channel.

Plain functions of a Plan (no MLIR, no simulator): chunk-pipeline and kernel-formation decide
with them, sim/ charges them.
"""
