"""A layer reporting how alike the cohort's precisions are (FOLA Fig. 11a), on any Gaussian-message algorithm."""
from __future__ import annotations

from bfedjax.core.types import Algorithm, require_message_keys
from bfedjax.models import num_params
from bfedjax.posteriors.similarity import mean_pairwise_precision_cosine


def with_precision_similarity(algorithm: Algorithm) -> Algorithm:
    """``algorithm`` that also reports ``precision_cosine`` every round: the mean, over pairs of the cohort's
    clients, of the cosine similarity of their normalised precision matrices (``posteriors.similarity``);
    with FOLA's two clients of Sec. IV-E, Fig. 11a's curve.

    The messages must hold ``"params"`` and ``"precision"`` (diagonal, or FOLA ``laplace="full"``'s matrix).
    The aggregation is unchanged but no longer streams: the round keeps every cohort message
    (``[K, d, d]`` for full precisions), which the pairwise comparison needs.
    """
    def server_update(server, messages, weights, mask, hparams, key):
        require_message_keys(messages, ("params", "precision"), "precision similarity",
                             "Gaussian messages ('params' and 'precision')", algorithm.name,
                             "use it with fola, fedcurv's authors variant or another method sending both")
        d = num_params(messages["params"]) // mask.shape[0]
        cosine = mean_pairwise_precision_cosine(messages["precision"], d, mask)
        server, metrics = algorithm.aggregate(server, messages, weights, mask, hparams, key)
        return server, {**metrics, "precision_cosine": cosine}

    return algorithm.replace(server_update=server_update, client_stats=None, server_from_stats=None)


__all__ = ["with_precision_similarity"]
