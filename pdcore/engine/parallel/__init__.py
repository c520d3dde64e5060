"""Data-parallel attention: its arguments (`dp_attention_args`), the group it joins
(`dp_attention`) and the gather/scatter of the MLP tokens across it (`dp_gather`)."""
