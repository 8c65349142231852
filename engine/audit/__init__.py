"""Privacy audit: attack a trained model to see what it reveals (``mpidp audit``).

DP-SGD's epsilon is a guarantee on paper; an audit checks it by attacking
the model. Each piece stands alone (host-side NumPy, no piece imports
another's internals):

==================  ==========================================================
``inputs``          checkpoint + prepared file, their checks, which rows are
                    members, non-members and the attacker's population sample
``scoring``         the model's log-probability of each row's label, per rank
``stats``           ROC, AUC, advantage, TPR at low FPR, bootstrap and exact
                    binomial intervals
``loss_threshold``  membership attack: the loss threshold (Yeom et al. 2018)
``calibrated``      membership attack: loss calibrated by a reference model
                    (Watson et al. 2022)
``reference``       trains that reference model on the population sample
``membership``      runs membership attacks and their bootstrap, over ranks
``inversion``       attribute inference by model inversion (Fredrikson et al.)
``report``          the text report
``command``         ``mpidp audit``: wires the above together
``compare``         the comparison in docs/audit.md: trains models, audits them
``canary``          the one-run canary audit: its run, canaries and scores
``canary_claim``    its test of the claim; what an audit of m canaries can show
``canary_result``   its result, verdict and text
``one_run``,        the binomial and f-DP lower bounds from guesses
``one_run_fdp``
==================  ==========================================================

Example (statistics alone)::

    >>> from engine.audit import stats
    >>> stats.auc([3.0, 2.0], [1.0, 2.0])    # pairs: 1, 1, 1, 1/2
    0.875
"""
