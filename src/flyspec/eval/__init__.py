"""`flyspec eval`: quality retention of the lossy verifiers against plain decoding."""
