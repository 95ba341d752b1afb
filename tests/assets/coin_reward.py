"""A reward that is a fair coin on the response text: half of all 2-response groups score equal."""

import zlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(zlib.crc32(solution_str.encode()) % 2)
