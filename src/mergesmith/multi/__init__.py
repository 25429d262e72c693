"""Multi-stage merges (mergekit-multi's format): several merge documents in one YAML file."""
