"""The colours of link kinds, shared by `epcc viz` (viz.py) and the simulator's Gantt chart
(sim/gantt.py), so a step looks the same in both pictures."""

KIND_COLOR = {"p2p": "#1f77b4", "d2d": "#9467bd", "rdma": "#d62728", "local": "#2ca02c", None: "#7f7f7f"}
KIND_FILL = {"p2p": "#dbe9f6", "d2d": "#ece2f4", "rdma": "#f9dcdc", "local": "#dff1df", None: "#eeeeee"}
