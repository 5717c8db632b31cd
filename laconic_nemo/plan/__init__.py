"""What runs before a launch, on the machine that starts it, before any rank, model or GPU exists:
the cluster layout (``layout``), the model folder and its tokenizer (``model_folder``), what the trainer builds
before step 1 (``step_one``), the pre-flight that ``plan`` and ``train`` share (``preflight``), the container images a
launch runs in and the attention kernel each runs (``images``) and the ``laconic-nemo plan`` command with the launch's
srun lines (``cli``).
"""
