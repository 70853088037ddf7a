"""`python -m trainer.export`: a run's checkpoint as a Hugging Face folder (`hf_folder`; `__main__` runs
it as the export job's entrypoint).

May import `trainer.checkpoint`, `trainer.hf`, `trainer.storage`, `trainer.config` and `trainer.prepare`
(`chat_model` renders the chat template as the training data was rendered); nothing imports it.
"""
