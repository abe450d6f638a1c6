"""The Gradio demo over dart_core. `dart-app` loads the models and serves it (app/launch.py)."""
