"""The three parts around the pipeline: ``deploy`` (template, package, deploy/destroy), ``local`` (the stand-in), ``drill``."""
