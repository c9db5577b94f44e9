"""``scripts/gpu-check``'s phases: the GPU proof that always comes back, and its CPU rehearsal.

Not part of the atroposd package (nothing of the product imports it): the runner
(:mod:`.runner`) and the phases (:mod:`.phases`, :mod:`.consumer`) drive the product's own code in
processes of their own; :mod:`.prepare` writes what a GPU machine without network needs.
"""
