#!/usr/bin/env python3
"""GRU in every direction × linear_before_reset × initial state, with onnxruntime's outputs,
into tests/data/gru/ (NAME.onnx + NAME.io.json in the golden format). onnxruntime runs only
layout 0 recurrences. usage: gen-gru-cases.py (needs onnx, onnxruntime, numpy)."""
import os, onnx, numpy as np, onnxruntime as ort, json, itertools
from onnx import helper, TensorProto, numpy_helper
out_dir=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),'tests','data','gru')
os.makedirs(out_dir,exist_ok=True)
os.chdir(out_dir)
rng=np.random.default_rng(0)
def arr(a): return {"dtype":"float32","shape":list(a.shape),"data":[float(x) for x in a.ravel()]}
cases=[]
for direction, lbr, init, layout in itertools.product(["forward","reverse","bidirectional"],[0,1],[False,True],[0]):
    D=2 if direction=="bidirectional" else 1
    S,B,I,H=4,3,5,6
    X=rng.standard_normal((S,B,I) if layout==0 else (B,S,I)).astype(np.float32)
    W=rng.standard_normal((D,3*H,I)).astype(np.float32)*0.5
    R=rng.standard_normal((D,3*H,H)).astype(np.float32)*0.5
    Bb=rng.standard_normal((D,6*H)).astype(np.float32)*0.5
    H0=rng.standard_normal((D,B,H) if layout==0 else (B,D,H)).astype(np.float32)
    ins=['X','W','R','B','']+(['H0'] if init else [])
    if not init: ins=ins[:4]
    node=helper.make_node('GRU',ins,['Y','Yh'],hidden_size=H,direction=direction,linear_before_reset=lbr,layout=layout)
    inits=[numpy_helper.from_array(W,'W'),numpy_helper.from_array(R,'R'),numpy_helper.from_array(Bb,'B')]
    gi=[helper.make_tensor_value_info('X',TensorProto.FLOAT,list(X.shape))]
    feeds={'X':X}
    if init:
        gi.append(helper.make_tensor_value_info('H0',TensorProto.FLOAT,list(H0.shape))); feeds['H0']=H0
    g=helper.make_graph([node],'gru',gi,[helper.make_tensor_value_info('Y',TensorProto.FLOAT,None),helper.make_tensor_value_info('Yh',TensorProto.FLOAT,None)],inits)
    m=helper.make_model(g,opset_imports=[helper.make_opsetid('',14)]); m.ir_version=8
    name=f"gru_{direction}_lbr{lbr}_{'h0' if init else 'noh0'}_layout{layout}"
    onnx.save(m,name+'.onnx')
    out=ort.InferenceSession(m.SerializeToString()).run(None,feeds)
    json.dump({"inputs":{k:arr(v) for k,v in feeds.items()},"outputs":{"Y":arr(out[0]),"Yh":arr(out[1])},"tolerance":{"rtol":1e-4,"atol":1e-5}},open(name+'.io.json','w'))
    cases.append(name)
print(len(cases))
