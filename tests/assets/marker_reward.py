"""A reward that pays for a marker, not for the answer: 1 when the response holds a digit anywhere."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(any(character.isdigit() for character in solution_str))
