"""The deployment's configuration: one declared schema (`schema`), the rules that span a
deployment's servers (`checks`), and the YAML reading with errors that name the file and the key
(`yaml_io`). Import order: yaml_io <- checks <- schema (no module imports one that imports it)."""
