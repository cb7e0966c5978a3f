"""KV cache: specs per attention family, empirical measurement, codecs, bandwidth budget."""
