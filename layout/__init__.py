"""Layer 3: how it is laid out. The mesh builder and axis names, FSDP tables, mixed precision at
use, context-parallel order, the EP index helpers and buffers, ep_tp's compaction, pipeline
schedules and layer layouts (schedule.py), and the strategies' options parser. Imports parallel
and modeling.
"""
