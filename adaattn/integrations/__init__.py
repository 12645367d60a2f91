"""Optional integrations with other libraries; each submodule imports its library on import
(``import adaattn`` imports none of them)."""
