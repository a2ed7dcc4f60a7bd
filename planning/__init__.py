"""The planner (`python run.py --plan`): which layout for this model on this cluster.

clusters.py holds the cluster profiles as data; plan.py enumerates the candidate layouts on
abstract meshes, predicts each one's per-device memory and step time from the declarations and
the cost model, and ranks them; check.py compiles the best few (compile only) and sets the
prediction beside the compiled program's memory and bytes per (kind, axes).
"""
