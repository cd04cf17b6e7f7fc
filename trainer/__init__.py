"""LoRA training as a library: data validation and tokenization, PEFT training, adapter export.

No Celery and no database in here: the worker (``worker/``) and the ``loraplex train`` command both
call ``trainer.train.train_adapter``. Import from the submodules; this package imports nothing, so that
importing ``trainer.errors`` or ``trainer.progress`` does not pull in torch.
"""
