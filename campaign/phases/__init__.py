"""The campaign's phases, in the order every rank runs them (``worker.rank_main``).

``reference``: the clean run from step 0, kept at every step, the model's
shape measured. ``clean_checks``: every configuration on the clean run (no
alarm, the same final state) and a restart from a snapshot; the magnitude
trigger's clean history. ``soak``: clean training at the defaults.
``compute_fault`` and ``checkpoint_fault``: every run of one fault.
"""
