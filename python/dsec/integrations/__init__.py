"""Providers that put DSec sandboxes behind the provider slots of training and evaluation frameworks.

Each submodule (``dsec.integrations.<framework>``) imports its framework lazily or only where the
framework is installed, so importing one never requires another. docs/integrations.md describes
each one: the framework's commit its interface was read at, its configuration line, and how it was
tested.
"""
