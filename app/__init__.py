"""The Gradio demo over dart_core. `python -m app` loads the models and serves it (app/__main__.py)."""
